"""Stage 3, the output: the Parquet contract (part naming, listing parts), the exactly-once commit
protocol (write a part, record its checkpoint, tidy unrecorded parts) and the exports."""
