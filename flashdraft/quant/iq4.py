"""llama.cpp's IQ4 value table, shared by the IQ4_NL / IQ4_XS weights and the iq4_nl KV cache type."""

IQ4_NL_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)  # kvalues_iq4nl
