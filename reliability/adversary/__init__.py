"""The machine adversary and its oracle (``python -m reliability.adversary``, ``run.py``): seeded
random schedules of events against real processes, each run judged by an independent oracle from
a wiretap, the trainer's journal and the trainer's weights. It imports nothing of
``reliability.scenarios``."""
