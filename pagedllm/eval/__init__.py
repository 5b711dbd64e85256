"""Quality measurements over a loaded engine (perplexity on a fixed text)."""
