"""The demo and checking harness behind the command line (not the library): ``peerdcp run`` (one DCP attention
layer through the three mechanisms: ``run``, ``step``, ``geometry``), ``peerdcp generate`` (a transformers model
decoding with DCP: ``generate``) and the CPU rank processes both use (``launch``)."""
