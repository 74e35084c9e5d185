"""Kernels: one folder per op with ref.py (torch, runs on CPU) and the fast GPU version.

Each op's __init__ is its dispatch point: the fast implementation is used for CUDA
tensors when it exists, the reference otherwise (or everywhere with NINFER_KERNELS=ref).
"""
