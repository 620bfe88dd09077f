"""Memory the client hands the server or reads in place: shared buffers and
the helpers that find the file behind an address (``shm``), the registered
buffers and the staging area (``regions``), leases of the server's RAM tier
read in place (``leases``), and CUDA page-locking (``cuda``)."""
