//! A small ext4 filesystem on a loop device, made and mounted by a test
//! (root, mkfs.ext4 and loop devices; `make test` runs as root, as CI does).

use std::path::{Path, PathBuf};
use std::process::Command;

/// A loop-mounted ext4 filesystem, unmounted on drop.
pub struct LoopFs {
    /// Where it is mounted.
    pub mnt: PathBuf,
    /// Its image file.
    img: PathBuf,
}

impl LoopFs {
    /// An ext4 image of `mib` MiB in `dir`, mounted at `dir/mnt`.
    ///
    /// # Errors
    /// Why not (not root, a command missing or failing), for the test's panic.
    pub fn make(dir: &Path, mib: u64) -> Result<LoopFs, String> {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            return Err("not root: mounting a loop device needs root (run `make test` as root, as CI does)".into());
        }
        let img = dir.join("fs.img");
        let mnt = dir.join("mnt");
        std::fs::create_dir_all(&mnt).map_err(|e| e.to_string())?;
        let f = std::fs::File::create(&img).map_err(|e| e.to_string())?;
        f.set_len(mib << 20).map_err(|e| e.to_string())?;
        let run = |cmd: &mut Command| -> Result<(), String> {
            let out = cmd.output().map_err(|e| format!("{cmd:?}: {e}"))?;
            if out.status.success() {
                Ok(())
            } else {
                Err(format!("{cmd:?}: {}", String::from_utf8_lossy(&out.stderr)))
            }
        };
        run(Command::new("mkfs.ext4").args(["-q", "-F"]).arg(&img))?;
        run(Command::new("mount").args(["-o", "loop"]).arg(&img).arg(&mnt))?;
        Ok(LoopFs { mnt, img })
    }

    /// Unmounts it, as a drive gone from the host: `mnt` is left an empty
    /// directory on the filesystem holding it.
    #[allow(dead_code)] // not every test file that shares this module unmounts
    pub fn unmount(&self) {
        let out = Command::new("umount").arg(&self.mnt).output().expect("umount");
        assert!(out.status.success(), "umount {}: {}", self.mnt.display(), String::from_utf8_lossy(&out.stderr));
    }

    /// Mounts it again at `mnt`, as the drive put back.
    #[allow(dead_code)]
    pub fn mount(&self) {
        let out = Command::new("mount").args(["-o", "loop"]).arg(&self.img).arg(&self.mnt).output().expect("mount");
        assert!(out.status.success(), "mount {}: {}", self.mnt.display(), String::from_utf8_lossy(&out.stderr));
    }
}

impl Drop for LoopFs {
    /// Unmounts it; lazily when a plain `umount` fails (a filesystem shut
    /// down by `EXT4_IOC_SHUTDOWN` can answer busy while its last files
    /// close), so no test leaves a mount or a loop device behind (`mount -o
    /// loop` frees the device with the mount).
    fn drop(&mut self) {
        let quiet = |cmd: &mut Command| cmd.stderr(std::process::Stdio::null()).status().is_ok_and(|s| s.success());
        if !quiet(Command::new("umount").arg(&self.mnt)) {
            quiet(Command::new("umount").arg("-l").arg(&self.mnt));
        }
    }
}
