"""Turnkey integrations with trainers: ``miles`` (radixark/miles, disk-delta weight sync).

An integration may import ``trainer_client`` and ``policy_store``; workers never import it.
"""
