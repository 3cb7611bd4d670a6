"""Generation: the reverse process, its strategies (plain, fast, block model), prompts and batches."""
