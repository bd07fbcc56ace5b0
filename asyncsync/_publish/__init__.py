"""The publish round: weights in, the thread bridge, verification, progress, and the
round's phases."""
