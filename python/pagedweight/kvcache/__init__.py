"""Elastic KV cache: the KV pool grows and shrinks with the memory the pager frees or takes back."""
