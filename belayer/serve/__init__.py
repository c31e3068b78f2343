"""`belayer serve`: an OpenAI-compatible endpoint over durable agent sessions (app.py: HTTP; sessions.py: the calls)."""
