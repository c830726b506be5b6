"""Periodic jobs on the records: summaries for the dashboard (roll-up) and retention, one holder at a time."""
