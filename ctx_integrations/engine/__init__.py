"""Everything that touches torch: model loading, prompt layout, KV caches and the decoding modes."""
