"""Sparse backpropagation: update schemes and the search for the best one."""
