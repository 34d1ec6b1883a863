"""Reading a job's input file: where it is and in what format (source.py, resolved once at the
front doors), its physical lines with bounded memory (lines.py), Parquet and CSV tables
(table.py), and the default custom_ids a file's lines are given (custom_ids.py). What a line
or row means is the rest of input/'s business."""
