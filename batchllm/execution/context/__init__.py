"""A job's context length (max_model_len): how it is settled is chosen once per job, when the
job is created (plan.py), and carried out by one of the passes here; engine/sizing.py holds the
tokenizer-level measure (ContextSizer) they all share."""
