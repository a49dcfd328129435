"""The repository's own tools: the committed compatibility logs, benchmark target checks."""
