"""Pure quantize / dequantize functions for KV caches; no knowledge of backends."""
