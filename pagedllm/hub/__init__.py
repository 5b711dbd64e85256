"""Where checkpoints come from: the model store (pinned GGUFs and checkpoints by
short name, fetched through pip), the Hugging Face Hub client and its cache, and
the resolution of a model reference (name, path or Hub repo) to local files.
"""
