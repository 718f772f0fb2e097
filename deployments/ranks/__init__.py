"""The ingress's ranks, as one small wing: the only code that calls a rank.

- ``calls.py``: what a rank call is (``EncodeCall``, ``RankClient``,
  ``RankUnavailableError``);
- ``row.py``: one rank as a roster sees it; ``lifecycle.py``, ``health.py`` and
  ``loads.py``: the pure rules over rows (who takes work and who may be called at all,
  lateness and down/up, loads and progress);
- ``roster.py``: the async shell: every call goes through ``Roster.call`` (the gate,
  the send time on the one clock) and every outcome is booked by ``Roster.book``.
"""
