"""The encode tier (one process): preprocessing, ViT scheduling, embedding cache, transfer.

Importing it sets nothing process-wide: the process's own settings (MKL_CBWR) are made by
its entry point, services/encoder/main.py.
"""
