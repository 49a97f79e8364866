"""Where models come from: shipped configs (public architecture facts, no weights), local
config files and model folders (never remote code), transformers' default configs made
buildable, and multi-head latent attention decoded as serving runtimes decode it.
"""
