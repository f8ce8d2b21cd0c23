"""Retrieval that keeps every score: embedders, rerankers, normalisation and the document store."""
