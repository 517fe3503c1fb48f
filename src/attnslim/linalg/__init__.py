"""Pure tensor math: no modules, no hooks, no transformers imports."""
