"""Tensor parallelism: one model over several devices of a host, one process per rank.

``group``: the ranks' process group and the model's collectives; ``shards``: which part
of each weight a rank holds; ``layers``: the vocabulary-parallel embedding; ``protocol``:
the typed step rank 0 sends the other ranks; ``ranks``: starting, feeding and stopping
them (rank 0's side); ``rank_worker``: the loop of ranks 1..N-1.
"""
