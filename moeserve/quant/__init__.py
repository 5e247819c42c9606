"""Quantized weight storage: ``int8.py`` holds int8 rows with one fp32 scale each
(``Int8Weight``, ``Int8Tensor``), the storage of the int8 and w8a8_int8 weight formats
(``ops/formats``)."""
