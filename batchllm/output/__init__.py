"""Stage 3, the output: the Parquet contract (part naming, listing parts), the exactly-once commit
protocol (write a part, record its checkpoint, tidy unrecorded parts) and the exports.

The commit protocol is loaded with the package: it registers the tidying of ended jobs' output
as part of every commit (store/db.py `before_commit`), so a process that uses the output layer
at all tidies whatever job its transactions end."""

from batchllm.output import commit as _commit  # noqa: F401  (registers the hook)
