"""dlm report: a run's history read from its files, and the HTML page."""
