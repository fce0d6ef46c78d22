"""What a run records and shows: the history the callbacks fill, W&B helpers, the report and its figures."""
