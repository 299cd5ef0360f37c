"""`pagedserve bench peer | ladder | spec-decode`: pagedserve against llama.cpp's llama-server (and HF
transformers) on CPU, every engine on the same threads in a process of its own (child.py), alternated so that a
drifting machine costs each alike. llama_server.py runs the peer; engines.py holds what the three share."""
