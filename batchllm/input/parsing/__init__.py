"""One decoded input line checked and turned into a Request, or the problem refusing it."""
