"""The numbered reliability scenarios (``python -m reliability``, ``run.py``): fault-injection and
bad-input scenarios against the real system, whose figures make docs/reliability.md. Scenario 12
runs the machine adversary's campaign (``machine_adversary.py``); this room imports
``reliability.adversary``, never the other way round."""
