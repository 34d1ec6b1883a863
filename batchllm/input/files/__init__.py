"""Reading a job's input file: where it is and in what format (source.py, resolved once at the
front doors), its physical lines with bounded memory (lines.py), and the default custom_ids a
file's lines are given (custom_ids.py). What a line or a table's row means is the business of
the layers above (parsing/, validation/)."""
