"""The model side: which modules are norms and how they are described
(:mod:`~normwatch.measure.model.discovery`), what each kind should compute
(:mod:`~normwatch.measure.model.reference`), the fp16-safety probe
(:mod:`~normwatch.measure.model.probe`), running a copy of a layer apart from the watch
(:mod:`~normwatch.measure.model.isolation`), and FSDP2's shards
(:mod:`~normwatch.measure.model.sharding`).
"""
