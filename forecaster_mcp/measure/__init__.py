"""Measurers: replay of recordings and pycuda on a local GPU, behind one seam."""
