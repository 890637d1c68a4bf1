"""Models: REALM, reader, LM, RETRO, kNN-LM."""
