"""`dlm serve`: OpenAI's API over a dlm model, with batching across requests."""
