"""A whole input file validated into stored rows and error rows: JSONL line by line (validate.py)
or a block at a time (columnar.py), and tables (Parquet or CSV: table.py; a JSONL file's keys as
columns for a prompt template: jsonl_table.py) by the same rules."""
