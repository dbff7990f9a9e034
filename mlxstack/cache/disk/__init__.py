"""The disk tier behind the RAM prompt cache: entries written as checksummed safetensors files with
a sqlite index (``tier``, ``index``, ``safetensors_io``), the bridge to the prompt cache (``backing``:
write-through, spill, restore, load; ``records``: entries <-> disk records), where it lives and how
big it may grow (``config``), and the healing store's journal kept beside it (``journal``).
"""
