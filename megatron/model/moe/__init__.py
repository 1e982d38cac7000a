"""Mixture of experts: router, token dispatch over expert parallelism, experts."""
