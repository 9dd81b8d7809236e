"""The prefix-cache hit operators of hybrid models: the Bitmap type and the
fold/unfold operators over object groups (README.md, "The prefix-hit operators")."""
