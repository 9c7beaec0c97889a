"""GPU specifications and forgiving GPU-name matching."""
