"""Operating the server: launch, replay, the demo model, GPU smoke runs, replay speed."""
