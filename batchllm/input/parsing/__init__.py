"""One decoded input line checked and turned into a Request, or the problem refusing it, by the
table of the OpenAI endpoints a batch line may name (endpoints.py)."""
