"""The fused path: Inductor's FlexAttention lowerings and the compile-time records
(``inductor``), and naming and counting every run of a compiled graph (``runs``)."""
