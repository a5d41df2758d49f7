"""Helpers of the encoder tests: chat/image factories, the transformers oracle, server peers."""
