"""What runs where, below a plan: device slots and the sub-meshes they may be
(``sharding``, ``placement``), each stage program compiled for its slot
(``compilation``, ``accumulation``), a schedule's actions resolved into the steps
each worker runs (``steps``), and how values move between slots and processes
(``transport``, ``exchange``, ``agreement``, ``processes``). A plan
(:mod:`pipemark.runtime.plan`) is built from these; none of them knows a plan.
"""
