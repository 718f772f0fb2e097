"""Ray Serve application for the Kimi-K3 vision encoder (``build_app`` in ``app.py``).

Everything here is thin: admission, owner assignment and encoding come from
``kimi_encoder``, which never imports ray.
"""
