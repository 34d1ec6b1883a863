"""Process plumbing below every layer: child processes that end with their parent, the
`worker --concurrency N` supervisor, log formats for shippers."""
