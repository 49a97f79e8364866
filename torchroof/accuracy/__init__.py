"""How far an estimate is likely to be from a measurement: the published runs torchroof was
checked against (:mod:`torchroof.accuracy.measured`), the spread of measured / predicted
over the runs like a step (:mod:`torchroof.accuracy.fit`), and each estimate's expected
range and calibrated time (:mod:`torchroof.accuracy.expected`)."""
