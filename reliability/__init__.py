"""The reliability suite (see docs/reliability.md), in two rooms: the numbered scenarios
(``reliability.scenarios``, ``python -m reliability``) and the machine adversary with its oracle
(``reliability.adversary``, ``python -m reliability.adversary``)."""
