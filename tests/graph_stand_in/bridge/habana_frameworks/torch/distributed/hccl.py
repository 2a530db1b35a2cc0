"""Importing it registers the ``hccl`` collective backend; the stand-in's runs use gloo instead."""
