"""What a line, a request and a stored row are: the line formats and the normalized Request
(schemas.py), the stored input row (rows.py), the constraint and tools a request may carry, score
rows' shapes, prompt templates, text that cannot be encoded. The bottom of input/: it imports
nothing else of it, so every stage after the input reads a row through these alone."""
