"""OpenAI-compatible server over the real engine: `servetwin serve` (see app.py)."""
