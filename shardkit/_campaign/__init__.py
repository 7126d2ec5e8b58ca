"""``shardkit campaign``: several worker processes fuzzing one engine for a while, each
round an ordinary ``shardkit fuzz`` run from a seed derived from the campaign's, and one
merged report of what they found.

``seeds`` derives the round seeds; ``rounds`` holds what a round and a worker send back;
``worker`` is a worker process's body; ``run`` starts the workers and gathers their
rounds (and measures how the campaign scales, for ``shardkit bench``); ``cluster`` runs
the same rounds as tasks on a Ray cluster instead (``--cluster``); ``merge`` sums the
rounds and merges their failures; ``progress`` shows the campaign while it runs.
"""
