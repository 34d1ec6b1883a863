"""A job's front doors: submit it to the fleet, run it in this process, retry it, estimate its
cost. The CLI, the Python Client and the Batch API come in through these."""
